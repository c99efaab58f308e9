"""Model implementations and loaders for the embedded engine."""
