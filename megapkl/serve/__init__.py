"""`megapkl serve`: the embedded torch engine behind SGLang's HTTP API.

A stand-in for SGLang on machines where it cannot run (tests, CPU users). Nothing on megapkl's
production path imports this package.
"""
