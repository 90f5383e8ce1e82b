"""The shop's OpenAPI document, served at `/openapi.json`.

Written by hand (the shop is a Starlette app): each operation lists what its
handler answers, then `protected_operation` adds what LockMiddleware answers
for the route's `@locked`/`@idempotent` (read from the handler itself, so the
document follows the annotations). A schemathesis run against the shop holds
the two together (tests/test_openapi_schemathesis.py).
"""

from __future__ import annotations

from typing import Any

from ..asgi._annotations import annotations_of
from ..asgi._openapi import PROBLEM_SCHEMA, RETRY_AFTER, protected_operation
from ._store import ID_PATTERN

PROBLEM = {"application/problem+json": {"schema": PROBLEM_SCHEMA}}
ID = {"type": "string", "pattern": ID_PATTERN}
STOCK = {"type": "object", "required": ["product_id", "stock"],
         "properties": {"product_id": {"type": "string"}, "stock": {"type": "integer", "minimum": 0}}}
_ORDER_FIELDS: dict[str, Any] = {"order_id": {"type": "string"}, "user": {"type": "string"},
                                 "product_id": {"type": "string"}, "quantity": {"type": "integer"},
                                 "replica": {"type": "string"}}
ORDER = {"type": "object", "required": list(_ORDER_FIELDS), "properties": _ORDER_FIELDS}
# The answer to a checkout: each product of the cart, what was bought and what is left.
CHECKED_OUT = {"type": "object", "required": ["checkout_id", "items", "replica"], "properties": {
    "checkout_id": {"type": "string"}, "replica": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "required": ["sku", "quantity", "stock_left"],
                                         "properties": {"sku": {"type": "string"},
                                                        "quantity": {"type": "integer", "minimum": 1},
                                                        "stock_left": {"type": "integer", "minimum": 0}}}}}}
# The answer to an order: the order, and the stock left after it.
CREATED = {"type": "object", "required": [*_ORDER_FIELDS, "stock_left"],
           "properties": {**_ORDER_FIELDS, "stock_left": {"type": "integer", "minimum": 0}}}


def _json(schema: dict[str, Any], description: str, **headers: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        answer["headers"] = headers
    return answer


def _problems(*answers: tuple[int, str]) -> dict[str, Any]:
    """Problem answers of the handler itself; every route also has the shop's 500 and 503."""
    found = {str(status): {"description": text, "content": PROBLEM} for status, text in answers}
    found.setdefault("500", {"description": "An unexpected error (internal-error)", "content": PROBLEM})
    found.setdefault("503", {"description": "Redis is unavailable (redis-unavailable) or a lock was lost",
                             "content": PROBLEM, "headers": {"Retry-After": RETRY_AFTER}})
    return found


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _quantity(max_quantity: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"quantity": {"type": "integer", "minimum": 1, "maximum": max_quantity}}}


def operations(limits: dict[str, int]) -> dict[str, dict[str, dict[str, Any]]]:
    """The operations as the handlers answer them (before the middleware's answers are added)."""
    product = [{"name": "product_id", "in": "path", "required": True, "schema": ID}]
    bad_id = (400, "The product id is not 1-64 letters, digits, '_' or '-'")
    not_found = (404, "No such product (unknown-product), or no such path")
    too_large = (413, f"The request body is larger than {limits['max_body']} bytes")
    bad_body = (400, "The body is not a JSON object of the documented fields (invalid-json, invalid-body)")
    sold_out = (409, "Out of stock, the product is busy (lock-timeout), or a newer lock holder wrote first")
    deduct = {
        "summary": "Sell `quantity` items (default 1)",
        "parameters": product,
        "requestBody": _body(_quantity(limits["max_quantity"]), required=False),
        "responses": {"200": _json(STOCK, "The remaining stock"),
                      **_problems((400, f"{bad_id[1]}; or {bad_body[1]}"), not_found, sold_out, too_large)},
    }
    return {
        "/api/stock/{product_id}": {
            "put": {"summary": "Set a product's stock", "parameters": product,
                    "requestBody": _body({"type": "object", "required": ["stock"], "properties": {
                        "stock": {"type": "integer", "minimum": 0, "maximum": limits["max_stock"]}}}),
                    "responses": {"200": _json(STOCK, "The product's stock"),
                                  **_problems((400, f"{bad_id[1]}; or {bad_body[1]}"), not_found, too_large,
                                              (409, "A newer lock holder already wrote (stale-fencing-token)"))}},
            "get": {"summary": "A product's stock", "parameters": product,
                    "responses": {"200": _json(STOCK, "The product's stock"), **_problems(bad_id, not_found)}},
        },
        "/api/stock/{product_id}/deduct": {"post": {**deduct, "operationId": "deduct"}},
        "/api/stock/{product_id}/deduct-atomic": {"post": {**deduct, "operationId": "deductAtomic",
                                                           "summary": "The same sale as one Lua script, no lock"}},
        "/api/orders": {
            "post": {"summary": "Submit an order (deducts the product's stock)",
                     "parameters": [{"name": "X-User-Id", "in": "header", "required": True, "schema": ID,
                                     "description": "The buyer (demo only: a real shop names a verified caller)"}],
                     "requestBody": _body({"type": "object", "required": ["product_id"], "properties": {
                         "product_id": ID,
                         "quantity": {"type": "integer", "minimum": 1, "maximum": limits["max_quantity"]}}}),
                     "responses": {"201": _json(CREATED, "The order", Location={"schema": {"type": "string"}}),
                                   **_problems((400, f"{bad_body[1]}, or the X-User-Id is ill-formed"), not_found,
                                               sold_out, too_large)}},
            "get": {"summary": "Every order of a user",
                    "parameters": [{"name": "user", "in": "query", "required": True, "schema": ID}],
                    "responses": {"200": _json({"type": "object", "required": ["orders"], "properties": {
                        "orders": {"type": "array", "items": ORDER}}}, "The user's orders"),
                        **_problems((400, "The user id is ill-formed (invalid-user-id)"))}},
        },
        "/api/checkout": {
            "post": {"summary": "Buy a cart of several products, all or nothing (one lock per product)",
                     "operationId": "checkout",
                     "requestBody": _body({"type": "object", "required": ["items"], "properties": {
                         "items": {"type": "array", "minItems": 1, "maxItems": limits["max_cart_items"],
                                   "items": {"type": "object", "required": ["sku"], "properties": {
                                       "sku": ID,
                                       "quantity": {"type": "integer", "minimum": 1,
                                                    "maximum": limits["max_quantity"]}}}}}}),
                     "responses": {"200": _json(CHECKED_OUT, "What was bought, and the stock left of each product"),
                                   **_problems((400, f"{bad_body[1]}, or a product id is ill-formed"), not_found,
                                               (409, "A product is out of stock, busy (lock-timeout), or a newer "
                                                     "lock holder wrote first"), too_large)}},
        },
        "/api/exports": {
            "post": {"summary": "A report of the user's orders (at most two at once per user)",
                     "operationId": "exportOrders",
                     "parameters": [{"name": "X-User-Id", "in": "header", "required": True, "schema": ID,
                                     "description": "The user whose orders are exported (demo only)"}],
                     "responses": {"200": _json({"type": "object", "required": ["user", "orders", "items", "replica"],
                                                 "properties": {"user": {"type": "string"},
                                                                "orders": {"type": "integer", "minimum": 0},
                                                                "items": {"type": "integer", "minimum": 0},
                                                                "replica": {"type": "string"}}},
                                                "How many orders and items the user has"),
                                   **_problems((400, "The X-User-Id is ill-formed (invalid-user-id)"))}},
        },
        "/api/jobs": {"get": {"summary": "Runs of the once-per-tick job", "responses": {
            "200": _json({"type": "object", "required": ["runs"], "properties": {"runs": {"type": "array", "items": {
                "type": "object", "properties": {"tick": {"type": "integer"}, "replica": {"type": "string"}}}}}},
                "The job's runs"), **_problems()}}},
        "/healthz": {"get": {"summary": "This replica, its namespace and its Redis", "responses": {
            "200": _json({"type": "object", "required": ["status", "replica", "namespace", "locks", "redis"]},
                         "Healthy"), **_problems()}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "The Prometheus text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }


def document(endpoints: dict[tuple[str, str], Any], limits: dict[str, int]) -> dict[str, Any]:
    """The whole document; `endpoints` maps (path, method) to the handler whose annotations count."""
    paths: dict[str, dict[str, Any]] = {}
    for path, methods in operations(limits).items():
        for method, operation in methods.items():
            found = annotations_of(endpoints[(path, method.upper())], method.upper())
            paths.setdefault(path, {})[method] = protected_operation(
                operation, found.get("locked"), found.get("idempotent"))
    return {"openapi": "3.1.0",
            "info": {"title": "otel-lock demo shop", "version": "1",
                     "description": "Stock, orders and a scheduled job, safe on many replicas (docs/demo.md)."},
            "paths": paths}
