"""Optional integrations (extras), imported on demand."""
