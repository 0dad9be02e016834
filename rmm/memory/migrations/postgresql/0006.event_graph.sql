-- The memory bank, version 6: CompassMem's event graph (rmm/memory/graph.py). Events are memories of
-- kind 'event'; these tables relate them: participants, directed edges with a free-form label and
-- evidence turn ids (JSON text), topics and topic membership. Same columns as SQLite's tables, so
-- both stores run graph.py's statements; here foreign keys also guarantee that no edge or
-- membership outlives its event (ON DELETE CASCADE), whatever deletes the memory row.
CREATE TABLE graph_events (
    user_id      TEXT NOT NULL,
    memory_id    TEXT NOT NULL,
    participants TEXT NOT NULL,
    PRIMARY KEY (user_id, memory_id),
    FOREIGN KEY (user_id, memory_id) REFERENCES memories (user_id, id) ON DELETE CASCADE
);

CREATE TABLE graph_edges (
    user_id  TEXT NOT NULL,
    source   TEXT NOT NULL,
    target   TEXT NOT NULL,
    label    TEXT NOT NULL,
    evidence TEXT NOT NULL,
    PRIMARY KEY (user_id, source, target, label),
    FOREIGN KEY (user_id, source) REFERENCES memories (user_id, id) ON DELETE CASCADE,
    FOREIGN KEY (user_id, target) REFERENCES memories (user_id, id) ON DELETE CASCADE
);
CREATE INDEX graph_edges_target ON graph_edges (user_id, target);

CREATE TABLE graph_topics (
    user_id TEXT NOT NULL,
    topic   TEXT NOT NULL,
    summary TEXT NOT NULL,
    PRIMARY KEY (user_id, topic)
);

CREATE TABLE graph_members (
    user_id   TEXT NOT NULL,
    topic     TEXT NOT NULL,
    memory_id TEXT NOT NULL,
    PRIMARY KEY (user_id, topic, memory_id),
    FOREIGN KEY (user_id, topic) REFERENCES graph_topics (user_id, topic) ON DELETE CASCADE,
    FOREIGN KEY (user_id, memory_id) REFERENCES memories (user_id, id) ON DELETE CASCADE
);
CREATE INDEX graph_members_memory ON graph_members (user_id, memory_id);
