"""Every HTTP route, of the server and of the cross-server router, is declared by its path: a
decorator `@<router>.<method>("<path>")` in the module that defines its handler, so grepping a
path finds the code that serves it (no routes registered in loops or built from variables)."""

from __future__ import annotations

import inspect
import re

import pytest
from fastapi import APIRouter
from fastapi.routing import APIRoute

from lockstep.entrypoints.http_server import ROUTERS
from lockstep.router import server as router_server

APPS = {"server": ROUTERS, "router": (router_server.routes,)}


def _declared(route: APIRoute, method: str) -> bool:
    source = inspect.getsource(inspect.getmodule(route.endpoint))
    return re.search(rf'^@\w+\.{method.lower()}\("{re.escape(route.path)}"', source, re.M) \
        is not None


@pytest.mark.parametrize("app", sorted(APPS))
def test_each_route_is_a_decorator_naming_its_path(app):
    routers: tuple[APIRouter, ...] = APPS[app]
    routes = [r for router in routers for r in router.routes]
    assert routes and all(isinstance(r, APIRoute) for r in routes)
    missing = [f"{m} {r.path} ({r.endpoint.__module__}.{r.endpoint.__name__})"
               for r in routes for m in sorted(r.methods) if not _declared(r, m)]
    assert not missing, f"routes not declared by a decorator naming their path: {missing}"


def test_the_paths_a_client_relies_on_are_served():
    """The public surface of both apps (DESIGN.md section 6, SGLang's router API)."""
    served = {(m, r.path) for r in (x for rt in ROUTERS for x in rt.routes) for m in r.methods}
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models",
                 "/health", "/health_generate", "/get_model_info", "/get_server_info",
                 "/flush_cache", "/abort_request", "/metrics", "/tokenize", "/detokenize"):
        assert any(p == path for _m, p in served), path
    assert ("PUT", "/generate") in served and ("HEAD", "/health") in served
    routed = {(m, r.path) for r in router_server.routes.routes for m in r.methods}
    assert {("POST", "/add_worker"), ("POST", "/remove_worker"), ("GET", "/list_workers"),
            ("POST", "/generate"), ("GET", "/v1/models/{model:path}")} <= routed


def test_routes_with_a_body_read_it_as_json_whatever_the_content_type():
    """`curl -d` declares a form: a route with a JSON body must be a JSONRoute (middleware.py),
    which the route modules' APIRouter(route_class=JSONRoute) makes them."""
    from lockstep.entrypoints.middleware import JSONRoute

    with_body = [r for router in ROUTERS for r in router.routes if r.body_field is not None]
    assert with_body and all(isinstance(r, JSONRoute) for r in with_body), \
        [r.path for r in with_body if not isinstance(r, JSONRoute)]
