"""The dashboard's login (dashboard/login.py) through Streamlit's AppTest, which runs the app's scripts as the
server does for a browser session: without the token of the printed URL or the stack's user and password a session
gets the login prompt and none of the run data; with either, the pages."""

from tests.dashboard.conftest import LOGIN, PASSWORD, RUN, USER, open_app, texts


def _shows_no_run_data(at) -> None:
    assert not at.exception, [e.message for e in at.exception]
    assert not at.dataframe and not at.get("vega_lite_chart") and not at.metric
    assert RUN not in texts(at)  # not even the run's name
    assert "runs directory" not in texts(at)  # nor where the runs are (the sidebar caption)


def _shows_the_run(at) -> None:
    assert not at.exception, [e.message for e in at.exception]
    assert RUN in set(at.dataframe[0].value["run"])
    assert "1 run — 0 running, 1 finished, 0 failed" in texts(at)


def test_without_login_only_the_prompt(tiny_run, monkeypatch):
    at = open_app(tiny_run.parent, monkeypatch).run()
    _shows_no_run_data(at)
    assert [t.label for t in at.text_input] == ["user", "password"]
    at.switch_page("views/run_detail.py").run()  # another page's URL: the same prompt, no data
    _shows_no_run_data(at)


def test_a_wrong_token_or_password_is_refused(tiny_run, monkeypatch):
    at = open_app(tiny_run.parent, monkeypatch, "test-token-but-not-quite").run()
    _shows_no_run_data(at)
    assert "That token is not this dashboard's" in at.error[0].value
    assert "token" not in at.query_params
    for user, password in ((USER, "wrong"), ("admin", PASSWORD), (f"{USER}:", PASSWORD[1:]), ("", "")):
        at.text_input[0].set_value(user)
        at.text_input[1].set_value(password)
        at.button[0].click().run()
        _shows_no_run_data(at)
        assert at.error[0].value == "Wrong user or password.", (user, password)


def test_the_token_signs_in_and_leaves_the_address_bar(tiny_run, monkeypatch):
    at = open_app(tiny_run.parent, monkeypatch, LOGIN["FORGEWEAVE_DASHBOARD_TOKEN"]).run()
    _shows_the_run(at)
    assert "token" not in at.query_params  # out of the URL once used
    at.switch_page("views/run_detail.py").run()  # signed in for the session
    assert not at.exception and RUN in texts(at)


def test_the_stacks_user_and_password_sign_in(tiny_run, monkeypatch):
    """The app holds a digest of the password, never the password (`forgeweave dashboard`); compose's dashboard gets
    the password itself (docker/compose.yaml cannot compute a digest): both sign in with the password."""
    assert PASSWORD not in LOGIN["FORGEWEAVE_DASHBOARD_LOGIN"]
    for login in (LOGIN["FORGEWEAVE_DASHBOARD_LOGIN"], f"{USER}:{PASSWORD}"):
        monkeypatch.setitem(LOGIN, "FORGEWEAVE_DASHBOARD_LOGIN", login)
        at = open_app(tiny_run.parent, monkeypatch).run()
        at.text_input[0].set_value(USER)
        at.text_input[1].set_value(PASSWORD)
        at.button[0].click().run()
        _shows_the_run(at)
        assert not at.text_input  # the prompt is gone


def test_without_a_login_set_up_nothing_is_shown(tiny_run, monkeypatch):
    """`streamlit run dashboard/app.py` by hand, no secrets in the environment: closed, not open."""
    at = open_app(tiny_run.parent, monkeypatch, "")
    for key in LOGIN:
        monkeypatch.delenv(key)
    at.run()
    _shows_no_run_data(at)
    assert "no login set up" in at.error[0].value and not at.text_input
