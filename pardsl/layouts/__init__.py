"""Layouts: the algebra of placements and conversions (imports nothing else of pardsl), and the op rules."""
