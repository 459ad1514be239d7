"""Small helpers shared by data/ and trainer/ (no project imports, so any layer may use them)."""
