"""Answer extraction, normalisation and grading (math) and sandboxed execution (code)."""
