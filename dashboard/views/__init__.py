"""Page scripts of the dashboard; `dashboard/app.py` registers them with st.navigation and Streamlit runs them."""
