"""Thin recipes: each composes components (data, engines, store, model, train, export, eval) into a stage."""
