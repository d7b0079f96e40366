"""Template tags of the operator's console (the admin home's dashboard)."""
