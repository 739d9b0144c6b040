"""Command-line entry points: `p2pkv proxy`, `p2pkv up`, `p2pkv tiny-model`."""
