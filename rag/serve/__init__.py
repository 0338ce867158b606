"""rag serve: the FastAPI app, its request bounds, and its response bodies."""
