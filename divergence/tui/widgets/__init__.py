"""The browser's widgets."""
