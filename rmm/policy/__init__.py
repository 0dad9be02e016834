"""The learning policy: residual-linear reranker, Plackett–Luce sampling, REINFORCE learner, citations → rewards."""
