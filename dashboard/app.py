"""The dashboard's router: `forgeweave dashboard` serves these pages (it sets up the login dashboard/login.py asks for).

Each page is one module under views/. Pages only read run directories (and MLflow); the runs directory is
$FORGEWEAVE_RUNS_DIR, default ./runs. No page runs for a session that has not signed in (dashboard/login.py).
"""

import streamlit as st

from dashboard import loaders, login

st.set_page_config(page_title="forgeweave", page_icon=":material/model_training:", layout="wide")
login.require()  # before any page, loader or navigation: until then the session gets the login prompt only
pages = [
    st.Page("views/runs.py", title="Runs", icon=":material/list:", default=True),
    st.Page("views/run_detail.py", title="Run detail", icon=":material/monitoring:", url_path="run"),
    st.Page("views/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page("views/checkpoints.py", title="Checkpoints", icon=":material/save:", url_path="checkpoints"),
]
page = st.navigation(pages)
st.sidebar.caption(f"runs directory: `{loaders.runs_dir()}`")
page.run()
