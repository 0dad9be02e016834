"""Semantic XPath: the user's typed tree (read, add, edit, remove nodes), its schema Σ, and queries."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from rmm.memory.tree import TreeNode
from rmm.serve.deps import API_PREFIX, IdPath, Limits, Service, Tenant, UserPath
from rmm.serve.records import TreeSchema, XPathResult
from rmm.serve.schemas import AddNodesIn, EditNodesIn, RemoveNodeOut, TreeOut, TreeWriteOut, XPathIn
from rmm.serve.xpath import XPathRequest, node_edit

__all__ = ["router"]

router = APIRouter(prefix=API_PREFIX, tags=["tree"])


@router.get("/users/{user}/schema", response_model=TreeSchema)
def schema(user: UserPath, tenant: Tenant, service: Service) -> TreeSchema:
    """Σ of the user's tree, induced from what is stored: node types with counts, attribute names,
    parent → child type pairs with counts, and `text`, the same for an LLM prompt."""
    return service.schema(tenant, user)


@router.post("/users/{user}/xpath", response_model=XPathResult)
def xpath(user: UserPath, body: XPathIn, tenant: Tenant, service: Service, limits: Limits) -> XPathResult:
    """Execute a Semantic XPath query over the user's tree: the best `k` nodes with their weights,
    each step's best nodes, and a slate of the best leaves' memories reranked for `question` (a
    Gumbel top-`m` when exploring) whose `selection_id` `/v1/feedback` takes, as for a retrieve.
    A malformed query is a 422 `query_syntax` whose `errors[0]` gives `offset`, `column`, `expected`
    and `found`."""
    config = service.config
    k = body.k if body.k is not None else config.k
    m = body.m if body.m is not None else min(config.m, k)
    if k > limits.config.max_k:
        raise limits.refuse(f"k: {k} exceeds the limit of {limits.config.max_k}")
    if m > k:
        raise limits.refuse(f"cannot show m={m} memories out of k={k} candidates")
    limits.texts([body.query, body.question or ""], "query, question")
    request = XPathRequest(tenant=tenant, user=user, query=body.query, k=k, m=m,
                           explore=config.explore if body.explore is None else body.explore, scorer=body.scorer,
                           question=body.question)
    return service.xpath(request)


@router.get("/users/{user}/tree", response_model=TreeOut)
def tree(user: UserPath, tenant: Tenant, service: Service,
         as_of: Annotated[int | None, Query(ge=0, le=2**62, description="a generation: the tree as it was then")] = None
         ) -> TreeOut:
    """The user's tree in tree order: each node's latest version, or as it was after generation `as_of`."""
    generation, nodes = service.tree(tenant, user, as_of)
    return TreeOut(user=user, generation=generation, as_of=as_of, nodes=nodes)


@router.post("/users/{user}/tree/nodes", response_model=TreeWriteOut, status_code=201)
def add_nodes(user: UserPath, body: AddNodesIn, tenant: Tenant, service: Service, limits: Limits) -> TreeWriteOut:
    """Add nodes to the user's tree, all or nothing: a parent must be a node of the tree or of the
    request (404 `unknown_node` otherwise), a `memory_id` a stored memory of the user (404
    `unknown_memory`), ids new (422). Post the memories first (`/memories`): the user exists
    through them."""
    limits.count(len(body.nodes), limits.config.max_memories, "nodes")
    for i, node in enumerate(body.nodes):
        limits.texts(list(node.attributes.values()), f"nodes[{i}].attributes")
    nodes = [TreeNode(id=n.id, type=n.type, parent=n.parent, position=n.position, attributes=n.attributes,
                      memory_id=n.memory_id) for n in body.nodes]
    generation = service.add_nodes(tenant, user, nodes)
    return TreeWriteOut(user=user, node_ids=[n.id for n in nodes], generation=generation)


@router.patch("/users/{user}/tree/nodes", response_model=TreeWriteOut)
def edit_nodes(user: UserPath, body: EditNodesIn, tenant: Tenant, service: Service, limits: Limits) -> TreeWriteOut:
    """Write each edited node's next version (only the fields sent change; the old version stays
    in the node's history), all or nothing."""
    limits.count(len(body.edits), limits.config.max_memories, "edits")
    edits = []
    for i, edit in enumerate(body.edits):
        sent = {name: getattr(edit, name) for name in edit.model_fields_set}
        if set(sent) <= {"id"}:
            raise limits.refuse(f"edits[{i}]: nothing to change (send parent, position, attributes or memory_id)")
        limits.texts(list(edit.attributes.values()), f"edits[{i}].attributes")
        edits.append(node_edit({"id": edit.id, **sent}))
    generation = service.edit_nodes(tenant, user, edits)
    return TreeWriteOut(user=user, node_ids=[e.id for e in edits], generation=generation)


# `:path`: node ids are the caller's, and may contain "/" (sent percent-encoded)
@router.delete("/users/{user}/tree/nodes/{node_id:path}", response_model=RemoveNodeOut)
def remove_node(user: UserPath, node_id: IdPath, tenant: Tenant, service: Service) -> RemoveNodeOut:
    """Remove a node and its subtree from the latest tree (their memories stay; the history stays
    readable with `GET .../tree?as_of=`)."""
    return RemoveNodeOut(user=user, node_id=node_id, generation=service.remove_node(tenant, user, node_id))
