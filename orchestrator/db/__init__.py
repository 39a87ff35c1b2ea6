"""The database side: connections, the run store, queries, migrations, the embedded server."""
