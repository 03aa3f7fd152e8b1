"""test and demo models, apart from the library's core"""
