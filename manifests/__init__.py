"""AI-READI tables, Parquet schemas and participant-level splits."""
