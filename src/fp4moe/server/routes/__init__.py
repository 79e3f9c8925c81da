"""The API's routes, one module per endpoint family; each reads the app's ``Serving`` (``serving.serving``)."""
