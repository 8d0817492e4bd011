"""`GET /dashboard`: a static page (dashboard_static/) that polls `/dashboard/stats`.

The page shows every tenant's prompts, so it is the admin's: behind --admin-api-key (or the
one --api-key) when a key is set (server/auth.py). A browser cannot send a Bearer header
when it navigates, so it gets a login form instead (status 401); posting the admin key to
`/dashboard/login` sets an HttpOnly, SameSite=Strict session cookie valid for `/dashboard*`
only. The key never enters a URL, and the page's script never sees it. The form is read
under a small size limit and the read timeout, and an address that posts wrong keys too
often gets 429 for a while (server/limits.py).
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from aiohttp import web

from radixserve.server.dashboard_stats import DashboardStats, label_tree
from radixserve.server.limits import LOGIN_MAX_BODY_BYTES, LoginThrottle, read_body
from radixserve.server.state import state_of

STATIC_DIR = Path(__file__).parent / "dashboard_static"
STATIC_FILES = {  # URL name -> content type
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
SESSION_COOKIE = "radixserve_dashboard"
LOGIN_PATH = "/dashboard/login"
CSP = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:"
"""No inline script or style: a prompt's text shown in the tree can never run as code."""
NO_STORE = {"Cache-Control": "no-store"}
BOARD_KEY = web.AppKey("dashboard", DashboardStats)
SESSION_KEY = web.AppKey("dashboard_session", str)
THROTTLE_KEY = web.AppKey("dashboard_login_throttle", LoginThrottle)
FORM = "application/x-www-form-urlencoded"


def is_dashboard_path(path: str) -> bool:
    return path == "/dashboard" or path.startswith("/dashboard/")


def has_session(request: web.Request) -> bool:
    """Whether the request carries this server's dashboard cookie (on a dashboard path)."""
    token = request.app.get(SESSION_KEY)
    given = request.cookies.get(SESSION_COOKIE, "")
    if token is None or not is_dashboard_path(request.path):
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


def login_page(status: int = 401, message: str = "") -> web.Response:
    """A script-free form that posts the key in the body (never in the URL)."""
    body = (STATIC_DIR / "login.html").read_text().replace("{message}", message)
    headers = NO_STORE | {"Content-Security-Policy": CSP}
    return web.Response(status=status, text=body, content_type="text/html", headers=headers)


async def posts_key(request: web.Request, key: str) -> bool:
    """Whether this is the login form posting the right key (compared in constant time). A
    wrong key counts against the client's address; a throttled address is not even read."""
    if request.path != LOGIN_PATH or request.content_type != FORM:
        return False
    throttle = request.app.get(THROTTLE_KEY)
    if throttle is not None and throttle.retry_after(_address(request)) is not None:
        return False
    await read_body(request, state_of(request).config.http_read_timeout, LOGIN_MAX_BODY_BYTES)
    given = str((await request.post()).get("key", ""))
    if hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode()):
        return True
    if throttle is not None:
        throttle.record_failure(_address(request))
    return False


def unauthorized(request: web.Request) -> web.Response | None:
    """The login form where a browser lands without the key (429 while its address is
    throttled); None: the caller's 401."""
    if request.path == "/dashboard" and request.method == "GET":
        return login_page()
    if request.path != LOGIN_PATH:
        return None
    throttle = request.app.get(THROTTLE_KEY)
    wait_s = None if throttle is None else throttle.retry_after(_address(request))
    if wait_s is None:
        return login_page(message="Wrong key.")
    response = login_page(429, f"Too many wrong keys: try again in {wait_s} s.")
    response.headers["Retry-After"] = str(wait_s)
    return response


def _address(request: web.Request) -> str:
    return request.remote or ""


async def login(request: web.Request) -> web.Response:
    """Reached with the key (form, header) or no key set: the session cookie, then the page."""
    response = web.HTTPSeeOther("/dashboard", headers=NO_STORE)
    response.set_cookie(
        SESSION_COOKIE,
        request.app[SESSION_KEY],
        path="/dashboard",
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return response


async def page(request: web.Request) -> web.Response:
    headers = NO_STORE | {"Content-Security-Policy": CSP}
    return web.FileResponse(STATIC_DIR / "index.html", headers=headers)


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC_FILES:
        raise web.HTTPNotFound()
    headers = {"Content-Type": STATIC_FILES[name], "Cache-Control": "no-cache"}
    return web.FileResponse(STATIC_DIR / name, headers=headers)


async def stats(request: web.Request) -> web.Response:
    state = state_of(request)
    board = request.app[BOARD_KEY]
    core_stats = await state.client.stats()
    if board.tree_is_stale():
        tree = await state.client.call("tree_outline")
        board.set_tree(await state.off_loop(label_tree, tree, state.tokenizer.decode))
    spec_on = bool(state.engine_args.get("speculative_algorithm"))
    body = {"model": state.served_model_name} | board.build(core_stats, state.metrics, spec_on)
    return web.json_response(body, headers=NO_STORE)


def register_dashboard_routes(app: web.Application) -> None:
    app[BOARD_KEY] = DashboardStats()
    app[SESSION_KEY] = secrets.token_urlsafe(32)  # a restart logs every viewer out
    app[THROTTLE_KEY] = LoginThrottle()
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/stats", stats)
    app.router.add_post(LOGIN_PATH, login)
    app.router.add_get("/dashboard/{name}", static_file)
