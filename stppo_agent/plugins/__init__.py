"""User extensions (--import) and did-you-mean checks of names."""
