"""The inference engine, in rooms by concern, each a sub-package that imports only from the rooms below it
(``tests/test_layering.py`` checks the order): ``device`` < ``request`` < ``reference`` < ``runner``,
``loading`` < ``spec`` < ``loop`` < ``front``. ``docs/design.md`` walks a request through them."""
