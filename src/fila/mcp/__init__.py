"""`fila mcp`: the Model Context Protocol server over the API (docs/mcp.md): its tools
(`server`) and the streamable HTTP door with its bearer token (`http`)."""
