"""The retrieval server: batched retrieve, feedback into the learner, auth and durability."""
