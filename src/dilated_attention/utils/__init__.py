"""Small helpers shared by the layers above the operator: atomic file writes, optional
extras with install hints, and plotting."""
