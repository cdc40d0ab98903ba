"""One folder per model family: what ditq adds to one transformer architecture."""
