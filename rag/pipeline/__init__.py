"""The Python API: rag.load, RagPipeline, and one thin reader adapter per model kind."""
