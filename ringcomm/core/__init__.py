"""The group runtime below the facade: the group core, its progress engine, point-to-point,
requests, lifecycle and flight record, and regrouping (shrink, grow, rejoin)."""
