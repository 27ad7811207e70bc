"""Small helpers shared by the layers above the operator: atomic file writes, optional
extras with install hints, the device a command runs on, and plotting."""
