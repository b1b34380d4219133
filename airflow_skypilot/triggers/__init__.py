"""Triggers: watch submitted jobs from the triggerer, batched per connection."""
