"""Command-line layers, one module per sub-command: argument parsing over the Python API, nothing more."""
