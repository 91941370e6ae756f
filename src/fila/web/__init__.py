"""`fila serve`: the review queue in a browser (docs/review-web.md)."""
