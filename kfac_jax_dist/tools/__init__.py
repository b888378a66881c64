"""Stage 5, tools on a state: `checkpoint` (orbax save / restore, moving a
state between distributions) and `describe` (where everything lives, what
travels)."""
