"""Pure plotly figure builders, one module per concern: ``make_*_figure(data) -> go.Figure``."""
