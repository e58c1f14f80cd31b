"""Event sourcing: aggregates rebuilt from their streams, repositories and snapshots."""
