"""experience_dict package."""
