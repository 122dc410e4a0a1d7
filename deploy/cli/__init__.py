"""The `tandem` command: `tandem serve` and `tandem bench`."""
