"""fila from a program: a typed client over a queue root or a PostgreSQL queue (`client.Client`,
also `from fila import Client`), the one path the CLI and the MCP server call (docs/api.md)."""
