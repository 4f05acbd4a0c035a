"""Mixture specs: schema, planner, diff."""
