-- The memory bank, version 7: Semantic XPath's typed tree (rmm/memory/tree.py). One row per node
-- version: the node's type, parent, position among its siblings, attributes (JSON text), the memory
-- it shows (if any) and that memory's text at this version; `latest` marks each node's newest row,
-- `deleted` a tombstone, `revision` the user generation it was written at. Same columns as
-- SQLite's table, so both stores run tree.py's statements. No foreign key to memories: a node's
-- older versions keep their text when the memory they showed is deleted (tree.delete_memories
-- removes the nodes that still show it, in the deleting transaction).
CREATE TABLE tree_nodes (
    user_id    TEXT NOT NULL,
    node_id    TEXT NOT NULL,
    version    INTEGER NOT NULL,
    revision   BIGINT NOT NULL,
    latest     INTEGER NOT NULL,
    deleted    INTEGER NOT NULL,
    parent_id  TEXT,
    node_type  TEXT NOT NULL,
    position   BIGINT NOT NULL,
    attributes TEXT NOT NULL,
    memory_id  TEXT,
    text       TEXT,
    PRIMARY KEY (user_id, node_id, version)
);
CREATE INDEX tree_nodes_latest ON tree_nodes (user_id, latest);
CREATE INDEX tree_nodes_memory ON tree_nodes (user_id, memory_id);
