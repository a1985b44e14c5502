"""Training the family's lower tiers: data, precipitation recipes, exit-block features."""
