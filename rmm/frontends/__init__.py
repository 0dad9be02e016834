"""Query-side front ends that stand before retrieval (GOAL-MEM goal decomposition)."""
