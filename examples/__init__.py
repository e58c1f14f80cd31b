"""eventflow's examples, importable as ``examples.*``: ``eventflow demo`` runs ``examples.shop``."""
