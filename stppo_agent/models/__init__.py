"""Loading actors, critics and tokenizers; numeric precision; the default model."""
