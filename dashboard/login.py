"""Who may see the dashboard: a browser session shows nothing but a login prompt until it has signed in.

`forgeweave dashboard` (also the one `forgeweave up` starts) puts two things in the app's environment, which only
its user may read: $FORGEWEAVE_DASHBOARD_LOGIN, "user:pbkdf2_sha256$ROUNDS$SALT$DIGEST", the runs dir's stack user
(MLflow's, in `<runs>/.stack/auth/credentials.env`) and a salted digest of its password (the dashboard never holds
the password: `flows.stack_auth.login_digest` makes it), and $FORGEWEAVE_DASHBOARD_TOKEN, the token of the URL it
prints (`http://127.0.0.1:PORT/?token=...`). A session signs in with either; the token is then taken out of the
address bar (so it stays out of the browser's history and of screenshots). Secrets and digests are compared with
`hmac.compare_digest`. (docker/compose.yaml's dashboard gets "user:password" itself: a value without the scheme is
compared as it is.)
Started without either variable (`streamlit run dashboard/app.py` by hand), the app shows only how to start it.

The check runs in the router before any page, loader or `st.navigation`: a session that has not signed in gets no
page, so none of the run data (all of which reaches the browser over the app's WebSocket, as the output of a script
run) leaves the server. Signing in lasts for the session (a reload is a new session: the token URL or the login
again). Why not Streamlit's own `st.login`: it signs in through an OpenID Connect provider, which a local tool with
no network has not got; Streamlit has no password or token login of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import streamlit as st

LOGIN_VAR = "FORGEWEAVE_DASHBOARD_LOGIN"
TOKEN_VAR = "FORGEWEAVE_DASHBOARD_TOKEN"
KEY = "forgeweave_signed_in"
# what a signed-in session holds under KEY: an object only this process has, so no value a browser sends (a widget
# state is data, never this object) can pass for it
SIGNED_IN = object()


def _same(given: str, expected: str) -> bool:
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def token_ok(given: str) -> bool:
    return _same(given, os.environ.get(TOKEN_VAR, ""))


def login_ok(user: str, password: str) -> bool:
    expected_user, _, digest = os.environ.get(LOGIN_VAR, "").partition(":")
    user_ok = _same(user, expected_user)  # both checked, whatever the first gives
    return _password_ok(password, digest) and user_ok


def _password_ok(password: str, digest: str) -> bool:
    """`password` against "pbkdf2_sha256$ROUNDS$SALT$DIGEST" (hex), or, without that scheme, against the text itself
    (docker/compose.yaml gives the password: a compose file cannot compute a digest)."""
    scheme, _, rest = digest.partition("$")
    if scheme != "pbkdf2_sha256":
        return _same(password, digest)
    rounds, _, rest = rest.partition("$")
    salt, _, expected = rest.partition("$")
    if not rounds.isdigit() or not salt or not expected:
        return False
    try:
        given = hashlib.pbkdf2_hmac("sha256", password.encode(), bytes.fromhex(salt), int(rounds)).hex()
    except ValueError:
        return False
    return _same(given, expected)


def require() -> None:
    """Return when this session has signed in (or does so now); otherwise show the login prompt and stop the run."""
    if st.session_state.get(KEY) is SIGNED_IN:
        return
    if not os.environ.get(LOGIN_VAR) and not os.environ.get(TOKEN_VAR):
        st.error("This dashboard has no login set up: start it with `forgeweave dashboard --runs-dir DIR`.")
        st.stop()
    if "token" in st.query_params:
        given = st.query_params["token"]
        del st.query_params["token"]
        if token_ok(given):
            st.session_state[KEY] = SIGNED_IN
            return
        st.error("That token is not this dashboard's: open the URL `forgeweave dashboard` printed, or log in.")
    _prompt()
    st.stop()


def _prompt() -> None:
    st.title("forgeweave dashboard")
    st.caption("Log in with the stack's user and password (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in "
               "`<runs>/.stack/auth/credentials.env`), or open the URL with `?token=` that `forgeweave dashboard` "
               "printed.")  # fmt: skip
    with st.form("login"):
        user = st.text_input("user")
        password = st.text_input("password", type="password")
        if st.form_submit_button("Log in"):
            if login_ok(user, password):
                st.session_state[KEY] = SIGNED_IN
                st.rerun()
            st.error("Wrong user or password.")
