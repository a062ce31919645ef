"""Model building blocks shared by every model family."""
