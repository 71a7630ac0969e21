"""Architecture specs and stateless layer templates."""
