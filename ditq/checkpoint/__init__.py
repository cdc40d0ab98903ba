"""The diffusers directory layout, streaming safetensors I/O, the artifact manifest and digests."""
