"""One module per CLI command: argument handling and output; the work lives in the library."""
