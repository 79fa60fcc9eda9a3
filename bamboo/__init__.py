"""bamboo package."""
