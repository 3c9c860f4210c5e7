"""The Google GenAI controller: Gemini / Vertex AI context caches recorded in the spool store (pure
records, I/O drivers, generate, clean).
"""
