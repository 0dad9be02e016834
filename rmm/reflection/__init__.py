"""Reflection: prospective (sessions → topic memories) and retrospective (citations → rewards)."""

from rmm.reflection.prospective import Extractive, ProspectiveReflector, ReflectionStats
from rmm.reflection.retrospective import CitationFeedback, reflect_citations
from rmm.reflection.segment import EXTRACTIVE_LABEL, SegmenterConfig, TopicSegmenter

__all__ = ["EXTRACTIVE_LABEL", "CitationFeedback", "Extractive", "ProspectiveReflector", "ReflectionStats",
           "SegmenterConfig", "TopicSegmenter", "reflect_citations"]
