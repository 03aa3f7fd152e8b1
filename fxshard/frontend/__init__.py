"""front ends: capture of foreign models and plan importers"""
